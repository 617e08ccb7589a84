"""marft_lg.evaluation"""
