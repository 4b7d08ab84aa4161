"""What watches a model as it trains: the precision controller (``controller``), the
precision report (``report``; ``amp8.report`` builds one) and its weight statistics,
and the console they print to."""

from amp8.monitor.controller import Controller
from amp8.monitor.operand_health import watch_operands
from amp8.monitor.report import PrecisionReport
from amp8.monitor.report_log import ReportLog
from amp8.monitor.report_row import ReportRow
from amp8.monitor.what_if import WhatIf, WhatIfBlock, what_if

__all__ = [
    "Controller", "PrecisionReport", "ReportLog", "ReportRow", "WhatIf", "WhatIfBlock", "watch_operands", "what_if",
]
