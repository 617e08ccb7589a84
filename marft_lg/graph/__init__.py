"""marft_lg.graph"""
