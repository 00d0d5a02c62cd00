"""Hold a write lock on an SQLite file until killed: readers go on, writers wait and fail.

Usage: python hold_sqlite_write.py DBFILE  (prints "held" once the lock is taken)
"""

import sqlite3
import sys
import time

connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")
print("held", flush=True)
while True:
    time.sleep(60)
