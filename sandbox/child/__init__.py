"""The gate's driven children: the step driver and server, the channel evidence comes back on,
fork servers, and rank groups under torchrun."""
