"""The analyst: turns evidence (compiled reference, profiled target, source) into ranked intents.

``static_scan`` finds hand-written patterns straight from the source (``--static``, no runtime
evidence): ``from trainbridge.agents.analyst.static_scan import scan_repo``.
"""
