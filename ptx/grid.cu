// Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream
// serialization allowed (``runtime.launch.KernelLauncher(..., programmatic=True)``) may start
// while the kernel before it in the stream is still running; these two order the pair. Below
// sm_90 both compile to nothing (no such launch is made there), so kernels built for every GPU
// may call them.

// Let the stream's next kernel, if launched programmatically, start: it launches once every CTA
// of this grid has executed this or exited. Orders no memory (the next kernel's wait does).
extern "C" __device__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Wait until the grids this kernel depends on have completed and their writes are visible;
// returns at once in a kernel that was not launched programmatically.
extern "C" __device__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
