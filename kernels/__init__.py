"""pyggml.kernels"""
