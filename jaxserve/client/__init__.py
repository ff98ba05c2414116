"""jaxserve.client"""
