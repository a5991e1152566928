"""Kernel factories. Each returns a plain Python kernel function; callers jit it."""
