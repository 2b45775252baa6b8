"""Compatibility alias: the static scan moved to ``trainbridge.agents.analyst.static.scan``.

Kept so that code written against the old module path keeps importing; new code imports from
``trainbridge.agents.analyst.static.scan``.
"""

from trainbridge.agents.analyst.static.scan import (  # noqa: F401 - re-exported names
    SkippedFile,
    StaticScanError,
    StaticScanResult,
    __all__,
    scan_models,
    scan_repo,
    scan_repo_result,
    scan_source,
)
