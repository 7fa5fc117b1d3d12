"""tierstack.observability"""
