"""marft_lg.trajectories"""
