// region API: filled in by the region patch
