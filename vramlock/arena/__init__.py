"""The protocol: an arena's lock files and the members that contend for them.

directory   where an arena lives, opening it safely
lockfd      lock descriptors: the one module that calls flock(2) and fcntl locks
locks       token.lock (held = resident) and want.lock (held shared = waiting)
records     members' self-description records
journal     what happened: one line per member event, per user
roster      who is in an arena: kernel lock state merged with the records
budget      an arena's VRAM budget file and its sizes
units       budget residency: units of capacity.lock
footprint   what a budget member asks for: declared or measured
member      one participant's state machine, and ``vramlock.resident``
hint        wake-up hints (inotify) on the arena directory
waiter      ``vramlock wait``
team        team arenas: root-owned, shared by the members of a group
"""
