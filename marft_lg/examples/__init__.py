"""Example apps that ship with marft_lg: the paper's math team (the demo's app, problems and reward)."""
