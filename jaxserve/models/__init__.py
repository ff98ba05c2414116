"""jaxserve.models"""
