"""pyggml.rpc"""
