"""Memory a rank and its daemon share, not a transport: host memory in /dev/shm files
(`hostmem`) and GPU memory through the CUDA driver API (`cudadrv`, ctypes, no torch).
Every transport and the daemon build on it; it imports only `protocol`."""
