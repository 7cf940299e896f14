"""The wrapped command, as strategies and the runner see it.

process   the command's processes: spawn, signal, reap
control   the cooperative control channel (a socketpair of text lines)
context   the command, its channel and the orders to end, for strategies and demands
"""
