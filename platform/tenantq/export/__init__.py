"""tenantq.export: a model under a plan, written as a compressed-tensors checkpoint.

`schemes` decides what each tenantq format becomes (and what is refused) from the plan
alone; `writer` re-lays out the quantized params without re-quantizing them and writes the
folder atomically. vLLM and SGLang serve this layout; `tenantq.model.compressed` reads it back.
"""

from tenantq.export.schemes import NotExportable, export_problems
from tenantq.export.writer import (
    ExportResult,
    check_out,
    decide,
    export_checkpoint,
    export_command,
    export_plans,
)

__all__ = [
    "ExportResult",
    "NotExportable",
    "check_out",
    "decide",
    "export_checkpoint",
    "export_command",
    "export_plans",
    "export_problems",
]
