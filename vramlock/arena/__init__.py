"""The protocol: an arena's lock files and the members that contend for them.

directory   where an arena lives, opening it safely
lockfd      lock descriptors: the one module that calls flock(2) and fcntl locks
locks       token.lock (held = resident) and want.lock (held shared = waiting)
residency   how a member holds the GPU: the whole GPU, budget units, several GPUs
records     members' self-description records
journal     what happened: one line per member event, per user
roster      who is in an arena: kernel lock state merged with the records
budget      an arena's VRAM budget file and its sizes
units       budget residency: units of capacity.lock
asking      asking one budget resident to step aside, and nobody else
footprint   what a budget member asks for: declared or measured
member      one participant's state machine, and ``vramlock.resident``
hint        wake-up hints (inotify) on the arena directory
waiter      ``vramlock wait``
team        team arenas: root-owned, shared by the members of a group

Words, one idea each:

resident    holds the token (or, in a budget arena, its units): may use the GPU
queue       wait for residency as a waiter (``Residency.queue``; ``Member.acquire``
            is queue, then RESIDENT); ``wait_polite`` comes before it (no barging)
wanted      somebody waits for what a resident holds (the probe)
release     what a strategy does: free the command's GPU memory
step aside  drop the token (and units) once the memory is free (``Member.step_aside``;
            ``Member.release`` is the API's old word for it); ``drop`` at the locks
yield       release, step aside, queue, restore (``Member.yield_if_wanted``)
budget      an arena's total VRAM, in units; ``footprint``: what a member needs;
            ``units``: what it holds
"""
