"""The OpenCL C kernels (cl/*.cl) and the host side that builds and launches them."""
