"""Generation engine: jitted steps and the host loop that drives them."""
