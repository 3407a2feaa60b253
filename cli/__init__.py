"""pyggml.cli"""
