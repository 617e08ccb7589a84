"""marft_lg.serving"""
