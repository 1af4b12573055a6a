"""tenantq.report: the study report, read back from MLflow alone.

`load_study` reads a study's parent and trial runs from any tracking URI; `write_report` draws
the figures (Pareto front, capacity waterfall, needle grid, sensitivity, flips, timeline) into
one self-contained HTML file plus a static image of each. Nothing comes from the driver.
"""

from tenantq.report.html import ReportOutcome, write_report
from tenantq.report.study import StudyRecord, TrialRecord, load_study

__all__ = ["ReportOutcome", "StudyRecord", "TrialRecord", "load_study", "write_report"]
