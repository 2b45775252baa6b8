"""`python -m trainbridge` runs the command line."""

from trainbridge.graph.cli import main

main()
