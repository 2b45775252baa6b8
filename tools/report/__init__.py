"""A run's report: write.py writes report.md, report.html and the charts; claims.py says what may be claimed from
which figure; sections.py builds the sections below the result; rounds_svg.py plots a gate's rounds; page.py renders
the markdown as one self-contained HTML page."""
