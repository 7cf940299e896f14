"""``vramlock run``: the wrapper around a command.

runner       take the token, start the command, hand over to the scheduler
scheduler    the token loop around the running command
supervision  signals for the command, its stops, its exit
demand       when a released command wants the GPU back
proxy        ``--demand listen``: the TCP proxy in front of a server
"""
