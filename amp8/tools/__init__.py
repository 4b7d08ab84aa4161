"""The ``amp8`` command and the experiments it runs; never imported by ``import amp8``."""
