"""marft_lg.training"""
