"""Hold a lock on an SQLite file until killed.

Usage: python hold_sqlite_write.py DBFILE [exclusive]  (prints "held" once the lock is taken)

By default a write lock (readers go on, writers wait and fail); with
``exclusive``, readers wait and fail too.
"""

import sqlite3
import sys
import time

connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN EXCLUSIVE" if sys.argv[2:] == ["exclusive"] else "BEGIN IMMEDIATE")
print("held", flush=True)
while True:
    time.sleep(60)
