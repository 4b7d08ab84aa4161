"""What watches a model as it trains: the precision controller (``controller``), the
precision report (``report``; ``amp8.report`` builds one) and its weight statistics,
and the console they print to."""

from amp8.monitor.controller import Controller
from amp8.monitor.report import PrecisionReport

__all__ = ["Controller", "PrecisionReport"]
