"""jaxserve.engine"""
