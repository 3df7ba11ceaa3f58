"""The cluster's shared facts in Redis: the only package that imports ``redis``.

* :mod:`.rediskeys`: every Redis key name skippyd uses, built in one place (one Cluster hash slot per
  script's keys).
* :mod:`.coordination`: the warm-prefix table (``WarmTable``: ``ran``, ``warmest``, ``route``),
  second-hit promotion counts (``Promotions``), and the daemon's ``Coordinator``; each fact changes
  through one Lua script of the checkout's top-level ``lua/`` (packed into the wheel as
  ``skippyd/lua/``).
* :mod:`.redis_embedded`: the daemon's embedded default, a private ``redis-server`` it starts and
  supervises.

Importing this package loads nothing; import the module you need.
"""
