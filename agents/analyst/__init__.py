"""The analyst: turns evidence (compiled reference, profiled target, source) into ranked intents.

``static`` (a subpackage) finds hand-written patterns straight from the source (``--static``, no runtime
evidence): ``from trainbridge.agents.analyst.static.scan import scan_repo``. ``own_rewrites`` keeps a
re-analysis of the run's head from proposing the run's own rewrites again.
"""
