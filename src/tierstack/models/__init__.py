"""tierstack.models"""
