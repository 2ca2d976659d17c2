"""Offline training of the predictor on access logs (``cacheflow train``)."""
