"""Small kernels that show the PTX helpers at work outside attention: a tile GEMM with
cp.async + ldmatrix + mma.sync (``tile_gemm``) and Hopper wgmma / TMA GEMMs (``hopper_gemm``)."""
