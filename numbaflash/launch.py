"""Host-side launch utilities shared by the API and the demos."""

from __future__ import annotations


def raise_dynamic_shared_limit(kernel, argtypes, nbytes: int) -> None:
    """Allow ``nbytes`` of dynamic shared memory for a compiled kernel: above 48 KB a launch
    fails (CUDA_ERROR_INVALID_VALUE) until the function attribute is raised."""
    if nbytes <= 48 * 1024:
        return
    from cuda.bindings import driver as cu_driver
    from numba.cuda.cudadrv.driver import driver

    cufunc = kernel.overloads[tuple(argtypes)]._codelibrary.get_cufunc()
    attr = cu_driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
