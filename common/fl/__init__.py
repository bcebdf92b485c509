"""Eco-FL's pure core: non-IID digits, grouping and regrouping, aggregation, strategies.

What a federation service needs to decide, with no network: how homes are grouped
(by latency, by data, or jointly), how results are averaged and merged, and a seeded
virtual-clock simulation to compare the five strategies on real data.
"""
