"""The OpenAI-compatible HTTP side: `marft-lg serve`, its wire format and streams, the one client."""
