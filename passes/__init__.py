"""ssmc's passes, one a file. `pipeline.py` holds the order; `base.py` the Pass contract."""
