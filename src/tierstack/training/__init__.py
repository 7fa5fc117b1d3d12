"""tierstack.training"""
