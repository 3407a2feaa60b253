"""pyggml.models"""
