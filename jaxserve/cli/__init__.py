"""jaxserve.cli"""
