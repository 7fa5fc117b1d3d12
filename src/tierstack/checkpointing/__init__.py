"""tierstack.checkpointing"""
