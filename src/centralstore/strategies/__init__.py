"""The strategies: ``CentralStorageStrategy`` and ``OneDeviceStrategy`` over ``Strategy``."""
