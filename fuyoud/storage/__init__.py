"""The SSD array: devices (one data file each), the striping layout, the SQLite index, the
store (objects, versions, pins, quotas, allocation) and the transfers between shared
memory and the devices."""
from fuyoud.storage.device import Device
from fuyoud.storage.index import IndexDB, ObjectMeta
from fuyoud.storage.store import ReadItem, Store, StoreUsage, WriteItem

__all__ = ["Device", "IndexDB", "ObjectMeta", "ReadItem", "Store", "StoreUsage", "WriteItem"]
