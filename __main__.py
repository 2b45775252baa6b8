"""`python -m trainbridge` runs the command line."""

from trainbridge.graph.cli.app import main

main()
