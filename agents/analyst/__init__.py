"""The analyst: turns evidence (compiled reference, profiled target, source) into ranked intents.

``static`` (a subpackage) finds hand-written patterns straight from the source (``--static``, no runtime
evidence): ``from trainbridge.agents.analyst.static.scan import scan_repo``.
"""
