"""Host-side plumbing between the public API and the GPU: the fast kernel launcher
(``launch``), 16-bit device buffers (``buffers``), TMA tensor maps (``tensor_map``) and the
location of the PTX helper sources (``sources``)."""
