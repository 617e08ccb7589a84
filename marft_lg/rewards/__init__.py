"""marft_lg.rewards"""
