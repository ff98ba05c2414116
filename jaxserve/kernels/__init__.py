"""jaxserve.kernels"""
