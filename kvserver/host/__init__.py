"""Host memory: the daemon-wide arena carved into client regions and cache slabs, and the page
allocator of one client's region.

Owns: ``arena`` (HostArena: one lazily committed mapping) and ``pages`` (PageAllocator).
May import: ``copies`` (index checks), ``config`` and ``errors``.
"""
