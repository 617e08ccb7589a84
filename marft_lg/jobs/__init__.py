"""marft_lg.jobs"""
