"""marft_lg.tracing"""
