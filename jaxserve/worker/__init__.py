"""jaxserve.worker"""
